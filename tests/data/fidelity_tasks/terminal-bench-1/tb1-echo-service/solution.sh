#!/bin/bash
set -euo pipefail
cat > /app/echo_server.py <<'EOF'
import socketserver


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(self.request.recv(100))


socketserver.TCPServer.allow_reuse_address = True
socketserver.TCPServer(("127.0.0.1", 9000), Echo).serve_forever()
EOF
nohup python3 /app/echo_server.py > /tmp/echo.log 2>&1 &
echo $! > /app/server.pid
for i in $(seq 100); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', 9000), 1)" 2>/dev/null && break
  sleep 0.1
done
