import socket


def echo(text):
    with socket.create_connection(('127.0.0.1', 9000), timeout=5) as s:
        s.sendall(text.encode())
        return s.recv(100).decode()
