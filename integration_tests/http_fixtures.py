"""The shared HTTP server and reference LLM for the HTTP test modules, and the fixtures over them
(modules import the fixtures they use).

Not a conftest.py: a second `conftest` module would shadow tests/conftest.py, which unit tests import
as `conftest`. One server serves the whole session: the first module to ask starts it, the session's
end stops it (also when a test fails).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import pytest

from http_helpers import client
from http_server_process import HTTP_API_KEY, HTTP_MODEL, HTTP_NUM_BLOCKS, ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_shared = {}


@contextlib.contextmanager
def local_inference_client(url: str, token: Optional[str] = None, timeout: float = 120) -> Iterator:
    """huggingface_hub's InferenceClient for a server here. The test session runs with HF_HUB_OFFLINE=1 (no model
    hub here), which also blocks InferenceClient's requests to a local server: lifted while the block runs."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield InferenceClient(model=url, token=token, timeout=timeout)


def shared_server(config) -> ServerProcess:
    """`paged-backend serve tiny-llama` with an API key, ready; stopped when the pytest session ends."""
    server = _shared.get("server")
    if server is None:
        server = ServerProcess([HTTP_MODEL, "--dtype", "float32", "--num-blocks", str(HTTP_NUM_BLOCKS),
                                "--api-key", HTTP_API_KEY, "--log-level", "warning"])
        _shared["server"] = server
        config.add_cleanup(server.stop)
    server.wait_ready()
    return server


def shared_reference():
    """The offline `LLM` the server's greedy results must equal (same model, same dtype)."""
    if "llm" not in _shared:
        import torch

        from paged_backend import LLM

        _shared["llm"] = LLM(HTTP_MODEL, dtype=torch.float32, num_blocks=512)
    return _shared["llm"]


@pytest.fixture(scope="module")
def http_server(request):
    return shared_server(request.config)


@pytest.fixture(scope="module")
def http_reference():
    return shared_reference()


@pytest.fixture(scope="module")
def http(http_server):
    with client(http_server) as c:
        yield c
