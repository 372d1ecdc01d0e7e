"""The few Kubernetes API calls the node's rollout makes (issue 47), with the standard library:
HTTPS with the API server's CA, a bearer token, JSON in and out.

In a pod, everything comes from where Kubernetes puts it: the server from KUBERNETES_SERVICE_HOST
and _PORT, the token and the CA from the service account's projected volume (the token is read
again at each call: the kubelet rotates it). A cluster without a Service network (the project's
one-node test cluster, a node VM) names the server itself.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request

from oci_gpu_hook.errors import Exit, HookError

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TIMEOUT = 30
LIMIT = 16 << 20  # bytes of a reply: a Node or a Pod is a few KiB


class ApiError(HookError):
    exit_code = Exit.PREREQUISITE
    status = None  # the HTTP status, where the API server answered


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx is then an HTTPError, said as any other


class Client:
    def __init__(self, server: str, token_file: str, ca_file: str, timeout: float = TIMEOUT):
        if not server.startswith("https://"):
            raise ApiError(f"{server}: the API server is reached over https:// only")
        self.server, self.token_file, self.timeout = server.rstrip("/"), token_file, timeout
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ApiError(f"{ca_file}: not the API server's CA ({e})") from None
        # No proxy from the environment, and no redirect followed: urllib would carry the token
        # to wherever a 3xx points, plain http included.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect(),
                                                  urllib.request.HTTPSHandler(context=context))  # fmt: skip

    @classmethod
    def from_environment(cls, server: str | None = None, token_file: str | None = None,
                         ca_file: str | None = None) -> Client:  # fmt: skip
        """The pod's own credentials, where not given."""
        if server is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ApiError("no API server named, and KUBERNETES_SERVICE_HOST is not set (not in a pod?)")
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(server, token_file or f"{SERVICE_ACCOUNT}/token", ca_file or f"{SERVICE_ACCOUNT}/ca.crt")

    def request(self, method: str, path: str, body=None, content_type: str = "application/json") -> dict:
        """The reply's JSON; ApiError with the API server's own message on an error."""
        try:
            with open(self.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ApiError(f"{self.token_file}: unreadable ({e.strerror})") from None
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": content_type}
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with self.opener.open(request, timeout=self.timeout) as reply:
                return json.loads(reply.read(LIMIT) or b"{}")
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read(LIMIT)).get("message") or e.reason
            except ValueError:
                message = e.reason
            error = ApiError(f"{method} {path}: {e.code} {message}")
            error.status = e.code
            raise error from None
        except (OSError, ValueError) as e:
            raise ApiError(f"{method} {path}: {getattr(e, 'reason', e)}") from None

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def post(self, path: str, body) -> dict:
        return self.request("POST", path, body)

    def patch(self, path: str, body, strategic: bool = False) -> dict:
        kind = "application/strategic-merge-patch+json" if strategic else "application/merge-patch+json"
        return self.request("PATCH", path, body, kind)
