"""node/kubeapi.py against a real HTTPS server of the test's own (openssl's certificate for
127.0.0.1, Python's server): the CA is checked, the token goes only where it was sent, and a
redirect is never followed (urllib would carry the token to wherever it points, plain http too).
The API server itself: tests/e2e/test_gate_report_api.py."""

import http.server
import json
import os
import ssl
import subprocess
import threading

import pytest

from oci_gpu_hook.node import kubeapi


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers GET /ok with {} and GET /moved with a 302 to Recorder.target; records each
    request's path and Authorization header in the server's `seen`."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", self.server.target)
            self.end_headers()
            return
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def servers(tmp_path, require):
    """(https URL, its CA file, the https server, the plain http server)."""
    require("openssl")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    done = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    plain = http.server.HTTPServer(("127.0.0.1", 0), Recorder)
    secure = http.server.HTTPServer(("127.0.0.1", 0), Recorder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    for server in (plain, secure):
        server.seen = []
    secure.target = f"http://127.0.0.1:{plain.server_address[1]}/stolen"
    threads = [serve(plain), serve(secure)]
    yield f"https://127.0.0.1:{secure.server_address[1]}", str(cert), secure, plain
    for server in (plain, secure):
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(10)


def test_the_token_goes_to_the_server_its_ca_vouches_for_and_no_further(servers, tmp_path, monkeypatch):
    url, ca, secure, plain = servers
    token = tmp_path / "token"
    token.write_text("tok-SECRET\n")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")  # a proxy from the environment is not used
    client = kubeapi.Client(url, str(token), ca)
    assert client.get("/ok") == {"path": "/ok"}
    with pytest.raises(kubeapi.ApiError, match=r"^GET /moved: 302 ") as raised:
        client.get("/moved")
    assert raised.value.status == 302
    assert secure.seen == [("/ok", "Bearer tok-SECRET"), ("/moved", "Bearer tok-SECRET")]
    assert plain.seen == []  # the redirect was not followed: the token went nowhere else
    os.rename(ca, str(ca) + ".moved")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k2"),
                    "-out", ca, "-subj", "/CN=127.0.0.1", "-days", "1"], capture_output=True, check=True,
                   timeout=60)  # fmt: skip
    with pytest.raises(kubeapi.ApiError, match="CERTIFICATE_VERIFY_FAILED"):
        kubeapi.Client(url, str(token), ca).get("/ok")  # another CA: the server is not believed
