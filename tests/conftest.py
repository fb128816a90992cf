import os
import sys
from pathlib import Path

import pytest

from hfmeg.parallel.state import BACKEND_ENV

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ASSETS, RANDOM_KINDS, rewrite_config_v4, save_tiny  # noqa: E402

# CPU tests stay CPU on a GPU machine too: every ParallelState.from_env in this process and in
# the torchrun / recipe subprocesses the tests start joins gloo; GPU tests ask for nccl themselves.
os.environ.setdefault(BACKEND_ENV, "gloo")


def pytest_collection_modifyitems(items):
    """Tests marked `gpu` run after all others: once autograd has run on CUDA in this process it
    keeps a device thread, and ranks forked after that (`launch.spawn`) cannot run backward."""
    items.sort(key=lambda item: item.get_closest_marker("gpu") is not None)  # stable: order kept otherwise


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Random tiny checkpoints of every family, plus stories260K when the assets exist."""
    root = tmp_path_factory.mktemp("tiny")
    out = {kind: save_tiny(kind, root / kind) for kind in RANDOM_KINDS}
    rewrite_config_v4(out["llama3"])  # v4 keys for one model; the others keep v5 keys
    return out


@pytest.fixture(scope="session")
def stories_lora(tmp_path_factory) -> tuple[Path, Path]:
    """(stories260K, a fresh `peft` LoRA adapter for it: default init, B = 0), for the LoRA trainer tests
    (test_peft_train.py, test_peft_run.py, test_peft_reshard.py); skips where the assets are absent. Read-only: copy to change."""
    import torch
    from helpers import stories_or_skip
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = stories_or_skip()
    alpaca = ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("lora") / "adapter0"
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                     task_type="CAUSAL_LM")).save_pretrained(folder)
    return base, folder


@pytest.fixture
def namespace_hosts():
    """`make(n)`: a bed of `n` namespace hosts (tests/multihost.py), every one torn down after the test, also
    when it fails; the test skips with one line where namespaces cannot be made."""
    from multihost import Hosts, NamespaceUnavailable

    beds = []

    def make(n: int, **kw) -> Hosts:
        try:
            beds.append(Hosts(n, **kw))
        except NamespaceUnavailable as e:
            pytest.skip(str(e))
        return beds[-1]

    yield make
    for bed in beds:
        bed.close()
