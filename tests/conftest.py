import fcntl
import os
import resource
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

# Before anything imports huggingface_hub (it reads the setting once): no test sends usage telemetry, which would
# also leave a worker thread in the test process, and a live thread makes forkrun start real interpreters.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# On pytest-xdist workers (`make test`) each worker computes with its share of the cores, as a launcher gives each
# rank its own: two workers' two threads each on two cores would each wait at every parallel region's barrier for
# a thread the other worker's are keeping off a core (hfmeg/parallel/threads.py). Set before torch is imported,
# so that it holds for the worker, what it spawns and forks, and the scripts it starts; a given count is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

from hfmeg.parallel.state import BACKEND_ENV  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ASSETS, RANDOM_KINDS, rewrite_config_v4, save_tiny  # noqa: E402

# CPU tests stay CPU on a GPU machine too: every ParallelState.from_env in this process and in
# the torchrun / recipe subprocesses the tests start joins gloo; GPU tests ask for nccl themselves.
os.environ.setdefault(BACKEND_ENV, "gloo")


# The lanes. `make test` runs every test; `make test-quick` (`-m "not e2e and not multihost"`, on two pytest-xdist
# workers) the rest, in a few minutes, for development. Assigned here, by file or by test, so that one list says
# which lane a test is in:
# - multihost: the namespace-host beds (tests/multihost.py), several machines' worth of processes per test;
# - e2e: a multi-process end-to-end run: a trainer, recipe, tool or bench run (in a fresh interpreter, a forked
#   one or spawned ranks), a process start checked as such, one model's forward + backward (or its training
#   steps) over a whole matrix of layouts or families (the parity suites; the quick lane keeps a smaller
#   matrix of the same file where there is one), or a runtime step at a release's real shapes.
# - solo (not a lane: a marker of either): a test that times the product against a bound (a lost host or rank
#   named within its heartbeat bound, survivors stopped within seconds, a probe's timeout): on pytest-xdist
#   workers it runs with no other worker's test beside it (`_machine_share`).
# None: every test of the file; otherwise the named tests (parametrised ones by their function's name).
LANES: dict[str, dict[str, set[str] | None]] = {
    "solo": {"test_multihost_faults.py": {"test_survivors_name_the_lost_host_and_stop_within_the_bound",
                                          "test_a_stopped_rank_is_named_within_twice_the_bound"},
             "test_multihost_frozen.py": None,
             "test_torchrun_faults.py": {"test_survivors_of_a_killed_rank_stop_at_once_without_tracebacks"},
             "test_startup_checks.py": {"test_an_unreachable_hub_dataset_is_one_line_before_the_model_loads"}},
    "multihost": {name: None for name in ("test_multihost_bed.py", "test_multihost_faults.py",
                                          "test_multihost_frozen.py", "test_multihost_parity.py")},
    "e2e": {
        **{name: None for name in (
            "test_bench_activations.py", "test_bench_attention.py", "test_bench_comm_reduction.py",
            "test_bench_cp.py", "test_bench_dpo.py", "test_bench_moe.py", "test_bench_optimizer.py",
            "test_bench_peft.py", "test_bench_powersgd_convergence.py", "test_bench_shared_unlock.py",
            "test_bench_wgrad_fusion.py", "test_checkpoint_recovery.py", "test_cp_train.py", "test_dpo_train.py",
            "test_kill_sweep.py", "test_launch_recipes.py", "test_moe_recipe.py", "test_peft_parity.py",
            "test_peft_reshard.py", "test_peft_resume.py", "test_peft_run.py", "test_peft_train.py",
            "test_reshard_training.py", "test_run_lifecycle.py", "test_shared_unlock_train.py",
            "test_tokenizer_lowest.py", "test_tp_parity.py", "test_train.py", "test_verify_parity.py",
            "test_torchrun_faults.py", "test_releases.py", "test_quantized_releases.py", "test_grpo_parity.py",
            "test_gpu_loan.py", "test_kv_replication.py", "test_family_recipes.py", "test_resume_messages.py",
            "test_data_epochs.py", "test_gemma4_releases.py", "test_gemma4_kv_replication.py",
            "test_gemma4_small_releases.py", "test_vllm_engine.py", "test_bench_grpo.py", "test_qlora_parity.py",
            "test_kv_replication_lora.py", "test_qlora_moe.py", "test_weight_push.py", "test_grpo_layouts.py")},
        "test_bench_mfu.py": {"test_tiny_run_reports_both_sides_with_equal_losses",
                              "test_tiny_moe_run_counts_the_active_experts_and_the_planner_predicts_it",
                              "test_a_family_at_the_bench_shapes_has_transformers_losses",
                              "test_trainer_path_runs_packed_rows_and_defaults_to_tiny_without_a_gpu",
                              "test_tiny_fp8_side_trains_the_same_tokens_within_fp8_rounding"},
        "test_bench_peers.py": {"test_tiny_cpu_run_reports_every_row_and_skips_each_absent_peer_once"},
        "test_chat.py": {"test_chat_replies_equal_transformers_greedy_on_the_export",
                         "test_chat_on_a_lora_runs_adapter_and_checkpoint"},
        "test_cli.py": {"test_python_m_hfmeg_help_lists_every_command"},
        "test_config_validation.py": {"test_under_torchrun_a_config_error_is_one_line_and_workers_exit_2"},
        "test_docs.py": {"test_every_cpu_command_parses", "test_the_parse_check_catches_a_wrong_flag"},
        "test_fp8_training.py": {"test_layouts_equal_one_process",
                                 "test_a_training_run_in_fp8_says_what_it_converted_and_exports_the_master_dtype"},
        "test_import_cost.py": None,
        "test_moe_checkpoint.py": {"test_verify_parity_cli_on_moe"},
        "test_peft_damage.py": {"test_an_empty_trainer_state_under_torchrun_makes_every_rank_exit_2"},
        # the heaviest matrices of the quick lane's files (docs/testing.md); the 4-rank ones stay quick
        "test_cp_parity.py": {"test_cp_parity_on_eight_ranks_with_tp_pp_and_every_schedule"},
        "test_moe_parity.py": {"test_moe_parity_eight_and_sixteen_ranks"},
        "test_moe_training.py": {"test_expert_parallel_training_matches_adamw_reference"},
        "test_optim.py": {"test_matches_adamw_reference_all_layouts_and_modes"},
        "test_powersgd.py": {"test_full_rank_matches_uncompressed",
                             "test_expert_parallel_compresses_each_bucket_over_its_own_group"},
        "test_peft_plan.py": {"test_planner_predicts_lora_memory_at_7b_shapes_within_5_percent"},
        "test_trackers.py": {"test_tensorboard_mlflow_and_trackio_hold_the_runs_losses_and_config"},
        "test_grpo_train.py": {"test_grpo_learns_at_tp2_pp2_each_step_as_one_process"},
        # DPO/IPO/SimPO over the layouts vs TRL, full and LoRA (as test_grpo_parity's matrix); the MoE one stays quick
        "test_dpo_parity.py": {"test_dpo_matches_trl"},
    },
}


def lanes_of(item) -> list[str]:
    file, test = Path(str(item.fspath)).name, getattr(item, "originalname", item.name)
    return [lane for lane, files in LANES.items()
            if file in files and (files[file] is None or test in files[file])]


# The order tests run in. Tests marked `gpu` run after all others: once autograd has run on CUDA in a process it
# keeps a device thread, and ranks forked after that (`launch.spawn`) cannot run backward (on a CUDA machine the
# Makefile runs the suite in one process, so this order holds). Before them: the multi-host beds, then the e2e
# files, then the quick ones. On two pytest-xdist workers (`make test`, `make test-quick`: `--dist loadfile
# --no-loadscope-reorder`) each worker takes whole units in that order, one at a time as it becomes free (see
# `pytest_xdist_make_scheduler`): the long units start first and the short ones fill the end, so that neither
# worker idles long while the other finishes.
_PLACE = ("multihost", "e2e", None)


def _place(item) -> int:
    if item.get_closest_marker("gpu") is not None:
        return len(_PLACE)
    lanes = lanes_of(item)
    return next(i for i, lane in enumerate(_PLACE) if lane is None or lane in lanes)


def pytest_collection_modifyitems(config, items):
    """Each test gets its lane's marker (LANES), and the tests run in `_PLACE`'s order, gpu ones last."""
    for item in items:
        for lane in lanes_of(item):
            item.add_marker(lane)
    items.sort(key=_place)  # stable: the collection's order within a place


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile` a worker's unit is a file, except that the multi-host beds' files are one unit:
    their detection bounds are timed, so one bed runs at a time beside the other worker's tests, never two beds
    against each other. Units go out in the order of the collection (`--no-loadscope-reorder`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = Path(nodeid.split("::")[0]).name
            return "multihost" if file in LANES["multihost"] else file

    return Units(config, log)


@contextmanager
def _machine_share(folder: Path, alone: bool):
    """The machine, shared by the pytest-xdist workers whose session folder is `folder`: a test holds `share.lock`
    shared, or exclusive if it must run `alone`. A worker waiting to run alone holds `turn.lock` meanwhile, and
    every test takes `turn.lock` before its share, so the other worker's next test waits for it and the one
    running alone is not put off for ever by tests that keep starting."""
    turn, share = (os.open(folder / name, os.O_CREAT | os.O_RDWR) for name in ("turn.lock", "share.lock"))
    try:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turn, fcntl.LOCK_UN)
        yield
    finally:
        os.close(share)  # closing a descriptor drops its lock
        os.close(turn)


@contextmanager
def _own_core(worker: str):
    """Pin the calling thread, and so whatever it forks, spawns or starts meanwhile, to one of the cores this
    process may use: the N-th (modulo their count) for pytest-xdist worker `gwN`.

    Why: two workers' multi-rank tests share two cores, and gloo's collectives between ranks hand work from thread
    to thread across processes. On this VM, waking a task on the other core costs far more than on its own (an
    inter-processor interrupt through the hypervisor): 3,000 all-reduces of 1 KiB between 2 forked ranks took
    1.8 ms each and 2.4 s of system CPU on two cores, 0.68 ms and 0.8 s pinned to one; test_train's TP2xPP2
    30-step run 39 s of CPU and 27 s wall unpinned, 30 s and 30 s pinned (wall on one core, not two); eight of
    the heaviest e2e files on two workers 504 s CPU / 260 s wall unpinned, 445 s / 234 s pinned (2026-11-29).
    The two workers keep both cores busy, each on its own."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(cores)[int(worker.removeprefix("gw")) % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


@pytest.fixture(autouse=True)
def _machine(request, tmp_path_factory):
    """Under pytest-xdist, a test marked `solo` (LANES) runs alone on the machine, on every core; a multi-host bed
    on every core too (its ranks' heartbeats are timed); any other test on its worker's own core (`_own_core`).
    Serially every test runs alone, on every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        yield
        return
    alone = request.node.get_closest_marker("solo") is not None
    pinned = not alone and request.node.get_closest_marker("multihost") is None
    with _machine_share(tmp_path_factory.getbasetemp().parent, alone), (_own_core(worker) if pinned else nullcontext()):
        yield


@pytest.fixture(scope="session", autouse=True)
def _imported_before_forking():
    """What a forked rank or script run would otherwise import again each time, imported once in the test process
    before the first fork: torch._dynamo, which building any torch.optim optimizer imports (every trainer rank's
    DistributedOptimizer); transformers' modeling and generation modules, which building a transformers model
    imports (a reference in a rank, a GRPO run's transformers engine: ~0.85 s each); and matplotlib's pyplot, which
    a run's loss.png imports. None starts a thread. A 2-rank, 2-step test_train run spent 4.7 s of CPU in its ranks
    without this and 2.0 s with it, test_grpo_train's some twenty forked runs 103 s and 44 s (2026-11-29); the
    imports cost about 2 s once. (matplotlib is optional: without it there is no loss.png to draw.)"""
    import torch._dynamo  # noqa: F401
    import transformers.generation  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")  # as hfmeg.train.metrics.plot_curves sets it
    import matplotlib.pyplot  # noqa: F401


_START = time.monotonic()
_WORKERS_CPU: list[float] = []  # pytest-xdist (`make test-quick`): each worker's CPU seconds, as it reported them


def _cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, its waited-for children's)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_sessionfinish(session):
    """A pytest-xdist worker sends its CPU seconds, its children's included, to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["cpu_s"] = sum(_cpu_seconds())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKERS_CPU.append(getattr(node, "workeroutput", {}).get("cpu_s", 0.0))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The run's wall time and CPU time, its children's included (spawned ranks, subprocesses, torchrun and
    its workers: every process waited for; pytest-xdist's workers by what each reported, unless they were
    waited for already), as the last line, the figure README's suite time is read from."""
    own, children = _cpu_seconds()
    cpu = own + max(children, sum(_WORKERS_CPU))
    terminalreporter.write_line(f"suite time: {time.monotonic() - _START:.0f} s wall, {cpu:.0f} s CPU "
                                f"(children included) on {os.cpu_count()} CPUs")


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


@pytest.fixture(scope="session")
def multihost_run(tmp_path_factory):
    """`run(name, hosts, per_host, args_of, **kw)`: `(<out>, <logs>)` of the job `args_of(<out>)` run once per session
    under `name` on a bed of `hosts` namespace hosts, `per_host` ranks each (tests/multihost.py's `run_job`, `kw` to
    it), so that the tests of several files that compare with one run (test_multihost_faults's and
    test_multihost_frozen's uninterrupted run) share it; skips with one line where namespaces cannot be made."""
    from multihost import Hosts, NamespaceUnavailable, run_job

    runs: dict[str, tuple[Path, Path]] = {}

    def run(name: str, hosts: int, per_host: int, args_of, **kw) -> tuple[Path, Path]:
        if name not in runs:
            tmp = tmp_path_factory.mktemp(name)
            try:
                with Hosts(hosts) as bed:
                    run_job(bed, per_host, args_of(tmp / "run"), tmp / "logs", **kw)
            except NamespaceUnavailable as e:
                pytest.skip(str(e))
            runs[name] = tmp / "run", tmp / "logs"
        return runs[name]

    return run
