import urllib.error
import urllib.request


def test_server_answers_on_8080():
    body = urllib.request.urlopen("http://127.0.0.1:8080/index.html", timeout=10).read()
    assert body.strip() == b"ok"


def test_server_is_an_http_server():
    try:
        urllib.request.urlopen("http://127.0.0.1:8080/missing", timeout=10)
    except urllib.error.HTTPError as error:
        assert error.code == 404
    else:
        raise AssertionError("a missing page was served")
