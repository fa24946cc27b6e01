# A server on a UNIX socket bound to argv[1]: each client gets the server's PID, as text.
# Tests use it to see which process answers under a name (the original or its copy).
import os
import socket
import sys

s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(4)
while True:
    c, _ = s.accept()
    try:
        c.sendall(str(os.getpid()).encode())
    except OSError:
        pass  # a client that hung up early must not end the server
    c.close()
