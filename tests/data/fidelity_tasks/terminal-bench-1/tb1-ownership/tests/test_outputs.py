import os
import pwd


def test_deploy_user():
    assert pwd.getpwnam("deploy").pw_uid == 1200


def test_srv_app_owned_by_deploy():
    assert os.stat("/srv/app").st_uid == 1200


def test_archive_owner_kept():
    assert os.stat("/srv/app/conf/app.ini").st_uid == 3000
