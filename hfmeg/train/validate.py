"""Start-up validation: everything about a run that can be known before any heavy work.

`validate(cfg, world_size)` checks every numeric field's range, the batch and layout
arithmetic (or, with `parallel.layout: auto`, what contradicts the planner's choice),
evaluation against eval data, `--resume`, a writable `--out`, and
`--push-to-hub`'s repo id and token (and, for a LoRA run, a base named by Hub id), the trackers' libraries
(`report_to`); it raises `ConfigError` with one line naming the
field at the first problem and returns the warnings (e.g. a warm-up as long as the
run). It reads no model or data and makes no network call, so
`load_config` (the YAML file plus the command line's overrides, built and validated)
runs it on every rank: a bad config stops every rank the same way
before they join a process group or download a model. `check_hub_login` is the one
network check (whoami), with a short timeout: where the Hub cannot be reached the
check is skipped, said so, and never hangs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint.hub_ids import hub_id
from ..checkpoint.mp_layout import is_mp_folder
from ..data.config import PREFERENCE_FORMATS
from ..errors import LayoutError
from ..parallel.grid import KEPT_INSIDE_A_HOST, check_world
from ..parallel.state import ranks_per_host
from ..peft.config import expand_qlora
from .config import AUTO_FIELDS, TrainConfig, train_config
from .dataclass_io import ConfigError, load_yaml, set_dotted
from .grpo import check_config as check_grpo
from .parts import part_class
from .trackers import missing_line

WHOAMI_TIMEOUT_S = 10.0


def _at_least(value: float, low: float, field: str) -> None:
    if not value >= low:
        raise ConfigError(f"{field}: must be >= {low:g}, got {value:g}")


def _positive(value: float, field: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{field}: must be a finite number > 0, got {value:g}")


def _ranges(cfg: TrainConfig) -> None:
    m, p, o, lr, t, c = cfg.model, cfg.parallel, cfg.optim, cfg.lr, cfg.train, cfg.checkpoint
    for value, field in ((m.vocab_multiple, "model.vocab_multiple"), (m.ce_chunk_tokens, "model.ce_chunk_tokens"),
                         (p.tp, "parallel.tp"), (p.pp, "parallel.pp"), (p.vpp, "parallel.vpp"), (p.cp, "parallel.cp"),
                         (t.micro_batch_size, "train.micro_batch_size"),
                         (t.global_batch_size, "train.global_batch_size"), (t.max_steps, "train.max_steps"),
                         (t.eval_batches, "train.eval_batches"), (c.keep_last, "checkpoint.keep_last"),
                         (o.bucket_size, "optim.bucket_size")):
        _at_least(value, 1, field)
    for value, field in ((t.eval_every, "train.eval_every"), (t.max_skipped_steps, "train.max_skipped_steps"),
                         (c.save_every, "checkpoint.save_every"), (lr.warmup_steps, "lr.warmup_steps"),
                         (o.weight_decay, "optim.weight_decay"), (o.grad_clip, "optim.grad_clip"),
                         (lr.min_lr, "lr.min_lr"), (cfg.data.eval_split, "data.eval_split"),
                         (t.shared_layers_until, "train.shared_layers_until"),
                         (t.seed, "train.seed"), (cfg.data.seed, "data.seed"),
                         (t.heartbeat_timeout_s, "train.heartbeat_timeout_s")):  # numpy refuses negative seeds
        _at_least(value, 0, field)
    _at_least(cfg.data.seq_len, 2, "data.seq_len")
    _positive(o.lr, "optim.lr")
    _positive(t.collective_timeout_s, "train.collective_timeout_s")
    if t.num_epochs is not None:
        _positive(t.num_epochs, "train.num_epochs")
    _positive(o.eps, "optim.eps")
    for value, field in ((o.beta1, "optim.beta1"), (o.beta2, "optim.beta2")):
        if not 0 <= value < 1:
            raise ConfigError(f"{field}: must be in [0, 1), got {value:g}")
    if lr.min_lr > o.lr:
        raise ConfigError(f"lr.min_lr: {lr.min_lr:g} is above the peak optim.lr {o.lr:g}")


def _layout(cfg: TrainConfig, world_size: int) -> None:
    """The rank grid's own checks (`grid.RankGrid`), each reported under the field it is about; those that do not
    depend on one another all at once (one line each), so a layout is fixed in one go."""
    p, t = cfg.parallel, cfg.train
    _checked("parallel.tp x parallel.cp x parallel.pp", check_world, world_size, p.tp, p.cp, p.pp)
    grid = _checked("parallel.ep", p.grid, world_size)
    hosts = _checked("LOCAL_WORLD_SIZE", replace, grid, per_host=ranks_per_host())
    inside = [kind for kind in KEPT_INSIDE_A_HOST if kind in hosts.crossing()]
    problems = []
    for check in (lambda: _checked(f"parallel.{inside[0]}" if inside else "", hosts.check_hosts, p.allow_cross_host),
                  lambda: _pp_layers(p), lambda: _checked("data.seq_len", grid.check_sequence, cfg.data.seq_len),
                  lambda: _checked("train.global_batch_size", grid.check_batch, t.global_batch_size,
                                   t.micro_batch_size)):
        try:
            check()
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\nerror: ".join(problems))


def _pp_layers(p) -> None:
    if p.pp_layers is not None and (len(p.pp_layers) != p.pp * p.vpp or min(p.pp_layers) < 1):
        raise ConfigError(f"parallel.pp_layers: expected {p.pp * p.vpp} layer counts >= 1 (pp x vpp), "
                          f"got {p.pp_layers}")


def _checked(field: str, check, *args, **kwargs):
    """`check(*args, **kwargs)`, its LayoutError as a ConfigError naming `field`."""
    try:
        return check(*args, **kwargs)
    except LayoutError as e:
        raise ConfigError(f"{field}: {e}") from None


def _auto_layout(cfg: TrainConfig, overridden: Collection[str]) -> None:
    """What `parallel.layout: auto` cannot honour: it replaces every field in AUTO_FIELDS.

    A command-line value for one of them is refused, not ignored and not kept: the planner
    ranks whole layouts (a fixed tp with the rest searched is a search it does not offer),
    and silently dropping a flag the user typed would run something else than asked. A
    YAML's values are the recipe's defaults and are replaced. The batch arithmetic of
    `_layout` is the planner's to satisfy (it only proposes layouts that divide)."""
    if cfg.parallel.pp_layers is not None:
        raise ConfigError("parallel.pp_layers: a layer split fits one pp x vpp, and parallel.layout auto chooses "
                          "those (splitting evenly); drop it or use --layout manual")
    if is_mp_folder(Path(cfg.model.path)):
        raise ConfigError(f"model.path: {cfg.model.path} is an hfmeg shard folder, cut for one layout, and "
                          "parallel.layout auto chooses the layout; start from the HF model or use --layout manual")
    if cfg.parallel.plan_profile is not None and not Path(cfg.parallel.plan_profile).is_file():
        raise ConfigError(f"parallel.plan_profile: {cfg.parallel.plan_profile} is not a file (write one with "
                          "`hfmeg plan calibrate --out FILE`)")
    for key in AUTO_FIELDS:
        if key in overridden:
            raise ConfigError(f"{key}: set on the command line, but parallel.layout auto chooses it; drop it or use "
                              "--layout manual")


def _init(cfg: TrainConfig) -> None:
    """Random weights (`model.init random`) and the shared-unlock warm start that goes with them."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    if m.init == "random":
        if not m.config_from:
            raise ConfigError("model.config_from: model.init random needs the HF folder or Hub id whose config.json "
                              "and tokenizer to use (--config-from)")
        if m.path:
            raise ConfigError(f"model.path: {m.path!r} is given, but model.init random trains random weights of "
                              "model.config_from's architecture; drop --model")
        if is_mp_folder(Path(m.config_from)):
            raise ConfigError(f"model.config_from: {m.config_from} is an hfmeg shard folder; give an HF folder or "
                              "Hub id (or train from the shards with --model and model.init pretrained)")
    elif m.config_from:
        raise ConfigError("model.config_from: only read with model.init random (--init random); the weights, config "
                          "and tokenizer of model.init pretrained come from model.path")
    until = t.shared_layers_until
    if not until:
        return
    if m.init != "random":
        raise ConfigError("train.shared_layers_until: sharing gives every layer layer 0's weights, which would "
                          "discard a pretrained model's other layers; it is for model.init random")
    if cfg.parallel.layout == "auto" or cfg.parallel.pp > 1:
        raise ConfigError(f"train.shared_layers_until: shared layers need every layer on one rank (parallel.pp 1, "
                          f"layout manual); this run has pp {cfg.parallel.pp}, layout {cfg.parallel.layout}")
    if o.compression != "none" and o.compression_start_step < until:
        raise ConfigError(f"optim.compression_start_step: {o.compression_start_step} is before "
                          f"train.shared_layers_until {until}; compression state is per tensor and starts after "
                          "the unlock, so set compression_start_step >= shared_layers_until")


def _fp8(cfg: TrainConfig) -> None:
    if cfg.model.fp8 == "off":
        if cfg.model.fp8_exclude:
            raise ConfigError("model.fp8_exclude: only read with model.fp8 set to a recipe")
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"model.fp8: {cfg.model.fp8} needs torchao (pip install 'hfmeg[fp8]')")
    if cfg.peft.quantize is not None:  # the 4-bit base's matmul is bitsandbytes' (parallel/layers.py)
        raise ConfigError(f"model.fp8: {cfg.model.fp8} does not combine with a 4-bit base (peft.quantize: "
                          f"{cfg.peft.quantize}); set model.fp8 off or train plain LoRA")


def _preference(cfg: TrainConfig) -> None:
    pref, peft, data = cfg.preference, cfg.peft, cfg.data
    if pref.enabled != data.preference:
        raise ConfigError(f"data.format: {data.format}, but preference.loss_type {pref.loss_type} "
                          + (f"trains on pairs: use data.format {' or '.join(PREFERENCE_FORMATS)}" if pref.enabled else
                             "trains on next tokens: set preference.loss_type (sigmoid, ipo, simpo) for pairs"))
    if not (pref.needs_reference and peft.enabled):
        return
    # A LoRA run's reference is the base with the adapters off: the model its fresh adapters start as.
    if peft.init_from:
        raise ConfigError(f"peft.init_from: preference.loss_type {pref.loss_type} measures the policy against the "
                          "base with the adapters off, which is not where adapters loaded from a folder start; merge "
                          "them into the base first (hfmeg convert to-hf --merge) and train fresh adapters on it")
    if peft.modules_to_save:
        raise ConfigError(f"peft.modules_to_save: trained in place, so the base with the adapters off would not be "
                          f"the reference preference.loss_type {pref.loss_type} needs; drop them or train in full")


def _eval(cfg: TrainConfig) -> None:
    t, d = cfg.train, cfg.data
    if 0 < t.eval_every <= t.max_steps and not d.eval_sources and not d.eval_split:
        raise ConfigError(f"train.eval_every: {t.eval_every} asks for evaluation but there is no eval data: set "
                          "data.eval_split (records held out of training, e.g. 64 or 0.05) or data.eval_sources, or "
                          "train.eval_every=0")


def _resume(cfg: TrainConfig) -> None:
    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not Path(resume).is_dir():
        raise ConfigError(f"checkpoint.resume: {resume!r} is neither none, auto nor an existing checkpoint folder")


def _out(cfg: TrainConfig) -> None:
    # The nearest existing folder is where `out` will be created; access() also reports a
    # read-only file system (EROFS) to root, whom permission bits would not stop.
    out = Path(cfg.checkpoint.out).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"checkpoint.out: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"checkpoint.out: {existing} is not writable (read-only storage or no permission)")


def _trackers(cfg: TrainConfig) -> None:
    line = missing_line(cfg.report_to)
    if line is not None:
        raise ConfigError(line)


def _hub(cfg: TrainConfig) -> None:
    if cfg.hub.push_to_hub:
        check_push_target(cfg.hub.push_to_hub, part_class(cfg).base_of(cfg))


def check_push_target(repo: str, adapter_base: str | None = None) -> None:
    """`repo` is a valid Hub repo id and a token is there to upload with (offline: no network call);
    `adapter_base`: a LoRA run's base, which the pushed adapter must name by Hub id."""
    from huggingface_hub import get_token
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ConfigError(f"hub.push_to_hub: {repo!r} is not a valid Hub repo id ({str(e).splitlines()[0]})") from None
    if adapter_base is not None and hub_id(adapter_base) is None:  # the adapter names its base; others must find it
        raise ConfigError(f"hub.push_to_hub: a LoRA run pushes its adapter, which must name its base by Hub id, "
                          f"but model.path {adapter_base} is a local folder; give model.path as the base's Hub id")
    if is_offline_mode():
        raise ConfigError("hub.push_to_hub: HF_HUB_OFFLINE is set, so the upload would fail")
    if not get_token():
        raise ConfigError("hub.push_to_hub: no Hugging Face token found; set HF_TOKEN or run `hf auth login` "
                          "first (a run uploads at its end)")


def _peft(cfg: TrainConfig) -> None:
    """LoRA's own fields (`PeftConfig.check`), and what it is not combined with yet."""
    p = cfg.peft
    p.check()
    if not p.enabled:
        return
    if cfg.model.init == "random":
        raise ConfigError("peft.method: adapters train on a pretrained base; model.init is random")
    if is_mp_folder(Path(cfg.model.path)):
        raise ConfigError(f"peft.method: model.path {cfg.model.path} is an hfmeg shard folder; LoRA runs read the "
                          "HF base (folder or Hub id), which the exported adapter names as its base")
    if cfg.train.shared_layers_until:
        raise ConfigError("peft.method: train.shared_layers_until is for pretraining; set it to 0 with LoRA")
    if p.compute_dtype not in (None, cfg.model.dtype):
        raise ConfigError(f"peft.compute_dtype: {p.compute_dtype} differs from model.dtype {cfg.model.dtype}; the 4-bit "
                          "base is dequantized to the run's dtype (set model.dtype, or leave compute_dtype out)")


def validate(cfg: TrainConfig, world_size: int | None = None, overridden: Collection[str] = ()) -> list[str]:
    """Raise `ConfigError` at the first invalid setting; return warnings (one line each).

    `overridden`: the dotted keys the command line set (`load_config`'s overrides)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    _ranges(cfg)
    if cfg.parallel.layout == "auto":
        _auto_layout(cfg, overridden)
    else:
        if cfg.parallel.plan_profile is not None:
            raise ConfigError("parallel.plan_profile: only parallel.layout auto plans with a profile; drop it or use "
                              "--layout auto")
        _layout(cfg, world)
    _init(cfg)
    _peft(cfg)
    _fp8(cfg)
    _preference(cfg)
    check_grpo(cfg)
    _eval(cfg)
    _resume(cfg)
    _out(cfg)
    _hub(cfg)
    _trackers(cfg)
    warnings = []
    p = cfg.parallel
    if cfg.optim.compression == "powersgd" and p.layout != "auto" and world == p.tp * p.pp:
        warnings.append(f"warning: optim.compression: powersgd compresses the data-parallel gradient reduction, and "
                        f"parallel.tp x parallel.pp = {world} processes leave one data-parallel rank: it does nothing "
                        "here")
    if cfg.lr.warmup_steps >= cfg.train.max_steps:
        warnings.append(f"warning: lr.warmup_steps {cfg.lr.warmup_steps} >= train.max_steps {cfg.train.max_steps}: "
                        f"the learning rate never reaches optim.lr {cfg.optim.lr:g}")
    return warnings


def check_hub_login(repo_id: str, timeout: float = WHOAMI_TIMEOUT_S) -> str:
    """Ask the Hub whose token this is (rank 0, at start); returns one line to print.

    A rejected token raises `ConfigError`; no answer within `timeout` (offline, firewalled)
    skips the check. whoami runs in a daemon thread because a hung connection must not
    hold up the start of training."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    answer: dict = {}

    def ask() -> None:
        try:
            answer["user"] = HfApi().whoami()
        except Exception as e:  # noqa: BLE001 - reported below, whatever the transport raised
            answer["error"] = e

    thread = threading.Thread(target=ask, daemon=True, name="hfmeg-whoami")
    thread.start()
    thread.join(timeout)
    error = answer.get("error")
    if isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code in (401, 403):
        raise ConfigError("hub.push_to_hub: the Hub rejected the Hugging Face token (invalid or expired); "
                          "set a valid HF_TOKEN or run `hf auth login`")
    if "user" in answer:
        name = answer["user"].get("name", "?")
        namespace = repo_id.split("/")[0] if "/" in repo_id else name
        orgs = {o.get("name") for o in answer["user"].get("orgs", [])}
        if namespace != name and namespace not in orgs:
            raise ConfigError(f"hub.push_to_hub: the token belongs to {name!r}, which cannot create repos under "
                              f"{namespace!r}")
        return f"push to hub: {repo_id} as {name}"
    reason = type(error).__name__ if error is not None else f"no answer in {timeout:g} s"
    return f"push to hub: could not reach the Hub to check the token ({reason}); checked again at upload time"


def load_config(yaml_path: str | Path | None, overrides: dict[str, Any],
                world_size: int | None = None) -> tuple[TrainConfig, list[str]]:
    """The YAML file (if any) with dotted overrides (`{"optim.lr": 1e-4}`) applied on top, validated.

    Returns the config and the validation's warnings; `world_size` defaults to `$WORLD_SIZE` (1). The
    overrides are the command line: validation tells them from the YAML's defaults."""
    data = load_yaml(yaml_path) if yaml_path else {}
    for key, value in overrides.items():
        if value is not None:
            set_dotted(data, key, value)
    expand_qlora(data.get("peft") or {})
    cfg = train_config(data)
    if not cfg.model.path and cfg.model.init == "pretrained":
        raise ConfigError("model.path is required (--model)")
    if not cfg.data.sources:
        raise ConfigError("data.sources is empty (--data)")
    return cfg, validate(cfg, world_size, {k for k, v in overrides.items() if v is not None})
