"""`make demo`: the whole product on a CPU in a few minutes, from the project's own data.

1. Train a small byte-level BPE tokenizer on `data/` and build a tiny LLaMA with it.
2. Shard the model TP=2 x PP=2 over 4 gloo processes (sequence parallel, 1F1B).
3. Fine-tune it on `data/sft_sample.jsonl` with the overlapped distributed optimizer.
4. Export to HF, load it with transformers, and show a generation before and after.
5. Print where the loss curve and metrics are.

`--moe` does the same with a tiny Mixtral (4 experts, top-2, load-balancing loss on) sharded
TP=2 x EP=2 (two data-parallel ranks, each holding 2 of the experts) with sequence parallelism.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MixtralConfig, PreTrainedTokenizerFast

from hfmeg.checkpoint.tokenizer_files import save_tokenizer
from hfmeg.data import DEFAULT_CHAT_TEMPLATE, DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.trainer import Trainer

DATA = Path(__file__).resolve().parents[1] / "data"
PROMPTS = ["Which city is the capital of France?", "Fern has 7 apples and gives away 2. How many apples are left?"]


def build_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    texts = [json.loads(line)["output"] for line in (DATA / "sft_sample.jsonl").open()]
    texts += [json.loads(line)["instruction"] for line in (DATA / "sft_sample.jsonl").open()]
    texts += (DATA / "text_sample.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + ["### Instruction:\n", "### Response:\n"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    save_tokenizer(fast, folder)  # loadable by transformers 4.x too
    return fast


def build_model(folder: Path, tok: PreTrainedTokenizerFast, moe: bool = False) -> None:
    torch.manual_seed(0)
    shape = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=len(tok), max_position_embeddings=256,
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # The Mixtral's experts are half the LLaMA's FFN width, so each token's top-2 experts compute about what it does.
    cfg = (MixtralConfig(intermediate_size=176, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         **shape) if moe else LlamaConfig(intermediate_size=352, **shape))
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)


def generate(folder: Path, prompts: list[str]) -> list[str]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    outs = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        gen = model.generate(ids, max_new_tokens=32, do_sample=False)
        outs.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return outs


def _train(cfg: TrainConfig):
    result = Trainer(cfg).run()
    return result.hf_folder, result.final_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/demo", help="output folder (replaced)")
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps")
    ap.add_argument("--moe", action="store_true", help="a tiny Mixtral at TP=2 x EP=2 instead of a LLaMA at TP=2 x PP=2")
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    base = out / "base"
    build_model(base, build_tokenizer(base), moe=args.moe)
    before = generate(base, PROMPTS)
    cfg = TrainConfig(
        model=ModelArgs(path=str(base), dtype="fp32"),
        parallel=(ParallelArgs(tp=2, ep=2, sequence_parallel=True) if args.moe
                  else ParallelArgs(tp=2, pp=2, sequence_parallel=True, schedule="1f1b")),
        optim=OptimizerConfig(mode="overlapped", lr=3e-3, weight_decay=0.0),
        lr=LRScheduleConfig(warmup_steps=10, total_steps=args.steps, decay="cosine", min_lr=3e-4),
        data=DataConfig(sources=[SourceConfig(str(DATA / "sft_sample.jsonl"))], format="alpaca", seq_len=256),
        train=LoopArgs(micro_batch_size=2, global_batch_size=16, max_steps=args.steps),
        checkpoint=CheckpointArgs(out=str(out / "run"), keep_last=1),
        report_to=[],
    )
    layout = "Mixtral (4 experts, top-2): TP=2 x EP=2" if args.moe else "LLaMA: TP=2 x PP=2"
    print(f"fine-tuning a {sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters()):,}-"
          f"parameter {layout} on 4 gloo processes, overlapped optimizer, {args.steps} steps")
    hf, loss = spawn(_train, 4, cfg, timeout_s=3600)[0]
    after = generate(Path(hf), PROMPTS)
    print(f"\nfinal train loss: {loss:.3f}   exported HF model: {hf}")
    for p, b, a in zip(PROMPTS, before, after):
        print(f"\nprompt : {p}\nbefore : {b!r}\nafter  : {a!r}")
    print(f"\nloss curve: {out / 'run' / 'loss.png'}   metrics: {out / 'run' / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
