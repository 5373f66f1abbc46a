"""Bad flags end in ``streamkv: error: ...`` naming the flag (exit 2), never a traceback."""
from __future__ import annotations

import pytest
import torch

from streamkv.cli import main as cli_main
from streamkv.server.config import ServerConfig
from tests.tiny_checkpoints import make_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m"), "llama"))


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:-1", "cuda:", "cpu:0", "cuda:01", "cuda:\u0663"])
def test_a_malformed_device_is_refused_by_name(tiny, device, capsys):
    # cuda:abc passed the check and torch raised "Invalid device string" from the engine factory
    assert cli_main(["generate", "--model", tiny, "--numerics", "fast", "--device", device, "hi"]) == 2
    assert "device must be cpu or cuda[:N]" in capsys.readouterr().err


def test_cuda_without_a_cuda_torch_is_refused_by_name(tiny, capsys):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    assert cli_main(["generate", "--model", tiny, "--numerics", "fast", "--device", "cuda", "hi"]) == 2
    assert "device=cuda: this torch" in capsys.readouterr().err  # was an AssertionError traceback


def test_a_session_dir_that_cannot_be_created_is_refused_by_name(tiny, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory must go: mkdir fails for any user
    argv = ["generate", "--model", tiny, "--max-tokens", "1", "--session-dir", str(blocker / "sessions"), "hi"]
    assert cli_main(argv) == 2
    assert "session_dir" in capsys.readouterr().err  # was a FileNotFoundError / NotADirectoryError traceback


@pytest.mark.parametrize("bad", [{"shutdown_timeout": float("nan")}, {"switch_interval": "0.01"},
                                 {"port": "8000"}, {"max_waiting": 2.5}])
def test_server_config_checks_types_and_nan(bad):
    # NaN passed `< 0` and made every shutdown abort in-flight requests at once (review)
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerConfig(**bad)
