"""The training command line: a YAML config plus flags, each flag one dotted override.

    hfmeg train --recipe sft_llama13b --model meta-llama/Llama-2-13b-hf --data tatsu-lab/alpaca \
        --tp 2 --pp 2 --max-steps 30 --out OUT --set optim.weight_decay=0.01
    hfmeg train my_run.yaml --max-steps 100          # your own YAML config
    recipes/sft_llama13b.py --model ... --data ...   # the same command line, the recipe's YAML built in

The built-in recipes' YAML configs ship inside the package (`recipes/*.yaml` beside this file), so an
installed hfmeg runs them without a checkout. Launch with `accelerate launch` or `torchrun` (`-m hfmeg
train ...`); a plain run is a world of one. `--print-config` prints the validated config as YAML and exits.
Bad configs exit with code 2 and one line naming the field, printed by rank 0 only
(every rank validates the same config and exits the same way). Under `torchrun` or
`accelerate launch` the launcher itself then exits 1 with its ChildFailedError
report: torch's elastic agent raises that for any failed worker, whatever its code.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

from ..errors import HfmegError
from .config import TrainConfig
from .validate import check_hub_login, load_config
from .dataclass_io import ConfigError, load_yaml, to_yaml
from ..flags import Parser
from .stop import exit_together

RECIPE_DIR = Path(__file__).parent / "recipes"  # package data (pyproject.toml), found by an installed hfmeg too
PRESET_DIR = RECIPE_DIR / "presets"
PRESETS = ("cpu",)  # PRESET_DIR / f"{name}.yaml"
RECIPES = {  # name -> what it trains; each is RECIPE_DIR / f"{name}.yaml"
    "sft_llama13b": "supervised fine-tuning, LLaMA-2-13B on one node of 8 x 80 GB (TP4 x DP2, SP)",
    "pretrain_llama": "continued pre-training of a LLaMA-family model on plain text",
    "sft_mixtral": "supervised fine-tuning, Mixtral-8x7B on two nodes of 8 x 80 GB (PP2 x DP8, EP8)",
    "dpo_llama": "preference tuning (DPO) of an SFT'd LLaMA-3-8B on one node of 8 x 80 GB (TP2 x DP4, SP)",
    "grpo_llama": "online RL (GRPO family, verifiable rewards) of an SFT'd LLaMA-3-8B on one node of 8 x 80 GB (TP2 x DP4)",
    "sft_gpt_oss": "supervised fine-tuning, gpt-oss-20b on one node of 8 x 80 GB (DP8, EP8)",
    "sft_qwen3_5": "supervised fine-tuning, Qwen3.5-9B on one node of 8 x 80 GB (TP2 x DP4, SP)",
    "sft_deepseek_v3": "supervised fine-tuning, DeepSeek-V3 on 32 nodes of 8 x 80 GB (PP32 x DP8, EP8)",
    "sft_qwen3": "supervised fine-tuning, Qwen3-8B on one node of 8 x 80 GB (TP2 x DP4, SP)",
    "sft_gemma3": "supervised fine-tuning, Gemma 3 12B on one node of 8 x 80 GB (TP4 x DP2, SP)",
    "sft_phi4": "supervised fine-tuning, Phi-4 on one node of 8 x 80 GB (TP2 x PP2 x DP2, SP)",
}
TRAIN_DESCRIPTION = """Train a model: a YAML config (CONFIG) or a built-in recipe (--recipe), plus flags that override it.

  hfmeg train --recipe sft_llama13b --model meta-llama/Llama-2-13b-hf --data tatsu-lab/alpaca
  torchrun --nproc-per-node 8 -m hfmeg train --recipe sft_llama13b --model ... --data ...
  hfmeg train my_run.yaml --tp 2 --max-steps 100 --set optim.weight_decay=0.01

built-in recipes:
""" + "\n".join(f"  {name:<15} {text}" for name, text in RECIPES.items())
QUIET_RANK_EXIT_DELAY_S = 3.0  # how long ranks other than 0 wait before exiting on a config error

# flag -> (dotted config key, type, help)
FLAGS = {
    "--model": ("model.path", str, "HF folder, Hub id, or hfmeg shard folder"),
    "--init": ("model.init", str, "pretrained | random (pretraining from scratch: random weights, transformers' "
               "initialisation, of the --config-from architecture)"),
    "--config-from": ("model.config_from", str, "HF folder or Hub id whose config and tokenizer --init random uses"),
    "--tp": ("parallel.tp", int, "tensor-parallel size"),
    "--pp": ("parallel.pp", int, "pipeline-parallel size"),
    "--vpp": ("parallel.vpp", int, "virtual pipeline chunks per rank (interleaved 1F1B when > 1)"),
    "--ep": ("parallel.ep", int, "expert-parallel size (MoE models; divides the data-parallel size and the "
             "expert count)"),
    "--cp": ("parallel.cp", int, "context-parallel size: each sequence split over N ranks (long contexts; "
             "data.seq_len a multiple of 2N)"),
    "--schedule": ("parallel.schedule", str, "gpipe | 1f1b | interleaved"),
    "--layout": ("parallel.layout", str, "manual | auto (the planner picks tp, pp, vpp, SP, schedule, micro-batch, "
                 "recompute)"),
    "--loss-type": ("preference.loss_type", str, "none | sigmoid (DPO) | ipo | simpo: the preference loss, named as "
                    "TRL names it (none: next-token training; docs/preference.md)"),
    "--beta": ("preference.beta", float, "the preference loss's beta (DPO's KL weight; SimPO's reward scale); in a "
               "GRPO run (--reward-funcs) grpo.beta, the KL weight, and --loss-type grpo.loss_type "
               "(grpo | bnpo | dr_grpo | dapo)"),
    "--num-generations": ("grpo.num_generations", int, "GRPO: completions sampled per prompt (docs/grpo.md)"),
    "--max-completion-length": ("grpo.max_completion_length", int, "GRPO: tokens a completion may have"),
    "--generator": ("grpo.generator", str, "GRPO: the generation engine: transformers (in-process) or vllm (a worker in .venv-vllm: make .venv-vllm)"),
    "--peft": ("peft.method", str, "none | lora | dora | qlora (train adapters on a frozen base; qlora: LoRA on a "
              "4-bit NF4 base with double quantization; docs/peft.md)"),
    "--peft-r": ("peft.r", int, "LoRA rank"),
    "--seq-len": ("data.seq_len", int, "tokens per packed row"),
    "--micro-batch-size": ("train.micro_batch_size", int, "rows per micro-batch"),
    "--global-batch-size": ("train.global_batch_size", int, "rows per optimizer step, all DP ranks"),
    "--max-steps": ("train.max_steps", int, "optimizer steps"),
    "--num-epochs": ("train.num_epochs", float, "stop after this many epochs of the training data, or at "
                     "--max-steps: the first reached"),
    "--eval-split": ("data.eval_split", str, "records of each source held out for eval, never trained on: a "
                     "count (64) or a fraction (0.05)"),
    "--eval-every": ("train.eval_every", int, "evaluate every N steps (0: never)"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--warmup-steps": ("lr.warmup_steps", int, "linear warm-up steps"),
    "--dtype": ("model.dtype", str, "bf16 | fp16 | fp32 (default: bf16 on GPUs, fp32 on CPU)"),
    "--optimizer": ("optim.mode", str, "overlapped | distributed | ddp"),
    "--recompute": ("model.recompute", str, "none | selective | full"),
    "--seed": ("train.seed", int, "random seed"),
    "--save-every": ("checkpoint.save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep-last": ("checkpoint.keep_last", int, "checkpoints to keep"),
    "--resume": ("checkpoint.resume", str, "none | auto | path to a checkpoint iteration folder"),
    "--out": ("checkpoint.out", str, "output folder (metrics, checkpoints, hf/)"),
    "--push-to-hub": ("hub.push_to_hub", str, "Hub repo id to upload the exported model to"),
    "--report-to": ("report_to", str, "trackers, comma-separated: tensorboard, mlflow, trackio, wandb; none: only "
                    "metrics.jsonl (default: tensorboard; docs/cli.md)"),
}


# argparse takes "-1e-3" for a flag (its negative-number rule misses exponents), so `--lr -1e-3`
# would fail as "expected one argument" instead of reaching the validator's message.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """`--lr -1e-3` -> `--lr=-1e-3` for the numeric flags, so the value is parsed as a value."""
    numeric = {flag for flag, (_, typ, _) in FLAGS.items() if typ in (int, float)}
    out: list[str] = []
    for tok in argv:
        if out and out[-1] in numeric and _NEGATIVE_NUMBER.match(tok):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def recipe_config(name: str) -> Path:
    """The YAML config of the built-in recipe `name` (a key of RECIPES)."""
    return RECIPE_DIR / f"{name}.yaml"


def parser(description: str, default_config: Path | None, prog: str | None = None) -> argparse.ArgumentParser:
    """A recipe script's parser (`default_config`: its YAML, which `--config` replaces), or `hfmeg train`'s
    (None: a CONFIG argument or `--recipe`)."""
    ap = Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if default_config is not None:
        ap.add_argument("--config", default=str(default_config), help="YAML config (default: %(default)s)")
    else:
        which = ap.add_mutually_exclusive_group()
        which.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config of the run")
        which.add_argument("--recipe", choices=RECIPES, help="a built-in recipe's YAML config (listed above)")
    ap.add_argument("--preset", choices=PRESETS, help="sizes for a kind of machine, over the config's: cpu (lr, "
                    "batch, sequence length, eval split and steps for a tiny model on CPU; recipes/presets/cpu.yaml)")
    ap.add_argument("--data", action="append", help="data source (Hub id, file, folder or glob); repeatable")
    ap.add_argument("--format", help="data format: alpaca | messages | sharegpt | text | preference | sharegpt_preference "
                    "(pairs, with --loss-type)")
    for flag, (key, typ, text) in FLAGS.items():
        ap.add_argument(flag, type=typ, help=f"{text} [{key}]")
    ap.add_argument("--reward-funcs", help="GRPO: reward functions, comma-separated: built-in names (accuracy, "
                    "think_format) or module:function; makes the run a GRPO run [grpo.reward_funcs]")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="sequence parallelism inside TP regions [parallel.sequence_parallel]")
    ap.add_argument("--private", action="store_true", default=None, help="create the Hub repo private [hub.private]")
    ap.add_argument("--overwrite", action="store_true", default=None,
                    help="with --resume none: start over in an --out that holds checkpoints [checkpoint.overwrite]")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other dotted override")
    ap.add_argument("--print-config", action="store_true",
                    help="print the config as YAML and exit without training, once validated for this world size "
                         "(WORLD_SIZE; 1 for a plain run); the model and the Hub are not read. A run writes the "
                         "config it trains with to OUT/config.yaml")
    return ap


def _config_file(args: argparse.Namespace) -> str | Path:
    if args.config:
        return args.config
    if getattr(args, "recipe", None):
        return recipe_config(args.recipe)
    raise ConfigError(f"no config: pass a YAML file (hfmeg train CONFIG) or a built-in recipe "
                      f"(--recipe {'|'.join(RECIPES)})")


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    """A nested YAML mapping as dotted keys (`{"optim": {"lr": 1}}` -> `{"optim.lr": 1}`)."""
    out: dict[str, object] = {}
    for k, v in data.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    # a preset first: every flag and --set below overrides it
    overrides = _flat(load_yaml(PRESET_DIR / f"{args.preset}.yaml")) if getattr(args, "preset", None) else {}
    overrides |= {key: v for flag, (key, _, _) in FLAGS.items()
                  if (v := getattr(args, flag[2:].replace("-", "_"))) is not None or key not in overrides}
    for key, value in (("parallel.sequence_parallel", args.sequence_parallel), ("hub.private", args.private),
                       ("checkpoint.overwrite", args.overwrite), ("data.format", args.format)):
        if value is not None or key not in overrides:
            overrides[key] = value
    if args.data:
        overrides["data.sources"] = [{"path": d} for d in args.data]
    if args.reward_funcs:
        overrides["grpo.reward_funcs"] = [f for f in args.reward_funcs.split(",") if f]
    if args.reward_funcs or load_yaml(_config_file(args)).get("grpo", {}).get("reward_funcs"):
        for key in ("loss_type", "beta"):  # a GRPO run's --loss-type and --beta are its own (TRL's names)
            overrides[f"grpo.{key}"] = overrides.pop(f"preference.{key}")
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise HfmegError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = value
    cfg, warnings = load_config(_config_file(args), overrides)
    for line in warnings:  # on stderr: stdout may be --print-config's YAML
        _say(line, sys.stderr)
    return cfg


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(line: str, file=None) -> None:
    """Print once per job: every rank checks the config, rank 0 speaks."""
    if _is_rank0():
        print(line, file=file, flush=True)


def fit_to_model(cfg: TrainConfig) -> None:
    """CPU runs of a GPU recipe: no torch.compile (GPU kernels), and a sequence the model supports; and
    what only the model's config.json can refuse before any process group exists (EP vs the expert count, CP
    vs the router's loss)."""
    from ..checkpoint.hf_reader import folder_quant_format
    from ..config import check_cp, check_ep, load_hf_config
    from ..families import model_config_from_hf
    from ..models.shared_layers import check_shareable
    from ..peft.adapters import check_model

    if not torch.cuda.is_available() and cfg.model.compile:
        _say("model.compile: torch.compile kernels are for GPUs; running eagerly on CPU")
        cfg.model.compile = False
    try:
        folder = cfg.model.hf_folder()
        hf = load_hf_config(folder)
        model_cfg = model_config_from_hf(hf)
    except HfmegError:
        return  # an MP checkpoint folder (the model's chunks check it), or an error the trainer reports in full
    folder_quant_format(folder, getattr(hf, "quantization_config", None))  # GPTQ, AWQ, ...: refused here
    check_ep(model_cfg, cfg.parallel.ep)
    check_cp(model_cfg, cfg.parallel.cp)
    if cfg.peft.enabled:
        check_model(model_cfg, cfg.peft)
    if cfg.train.shared_layers_until:
        check_shareable(model_cfg, cfg.parallel.pp)
    max_pos = model_cfg.max_positions
    if cfg.data.seq_len > max_pos:
        if cfg.data.seq_len % (2 * cfg.parallel.cp) == 0 and max_pos % (2 * cfg.parallel.cp):
            raise ConfigError(f"data.seq_len: {cfg.data.seq_len} > the model's max_position_embeddings {max_pos}, "
                             f"which does not split into 2 x parallel.cp = {2 * cfg.parallel.cp} chunks")
        _say(f"data.seq_len {cfg.data.seq_len} > the model's max_position_embeddings {max_pos}: using {max_pos}")
        cfg.data.seq_len = max_pos


def main(description: str, default_config: Path | None, argv: list[str] | None = None,
         prog: str | None = None) -> int:
    """A recipe script (`default_config`: its YAML) or, with None, `hfmeg train`; returns the exit code."""
    try:
        return _main(description, default_config, argv, prog)
    except KeyboardInterrupt:  # Ctrl-C before the trainer holds SIGINT (it saves and exits 130 itself after)
        _say("interrupted before training started; nothing was written", sys.stderr)
        return 130


def _main(description: str, default_config: Path | None, argv: list[str] | None, prog: str | None) -> int:
    from .grpo_trainer import GRPOTrainer
    from .trainer import Trainer

    args = parser(description, default_config, prog).parse_args(
        _attach_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        cfg = config_from_args(args)
        if args.print_config:  # validated; nothing read from the model or the Hub
            if _is_rank0():
                print(to_yaml(cfg), end="", flush=True)
            return 0
        if cfg.hub.push_to_hub and _is_rank0():  # rank 0 uploads, so only its view of the Hub matters
            _say(check_hub_login(cfg.hub.push_to_hub))
        fit_to_model(cfg)
    except HfmegError as e:
        exit_together()
        if _is_rank0():
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank finds the same error, but only rank 0 says it. A launcher kills the other workers as soon
            # as one exits, so a silent rank that exited first could take rank 0's line with it.
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return 2
    try:
        result = (GRPOTrainer if cfg.grpo.enabled else Trainer)(cfg).run()  # rank 0 prints the run's summary, the exported folder included
    except HfmegError as e:
        if e.agreed:
            exit_together()
        if e.agreed and not _is_rank0():  # every rank raised it together: rank 0 says it (see above)
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        else:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # e.g. a full disk under a write no deeper layer named; the traceback adds nothing
        print(f"error: {e.filename or cfg.checkpoint.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return result.exit_code  # 128 + the signal that stopped the run (130: Ctrl-C), its checkpoint saved


def train_command(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`hfmeg train`: CONFIG or --recipe NAME, then the recipes' flags."""
    return main(TRAIN_DESCRIPTION, None, argv, prog)
