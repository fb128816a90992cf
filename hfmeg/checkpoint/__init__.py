"""Model-tensor I/O: the HF <-> MP key table and the shard layout, offline and at run time.

Offline tools (whole checkpoints on disk, no process group): `convert.py` (HF -> MP and
back, with `hf_reader.py` / `hf_writer.py`), `reshard.py` (MP -> MP), `parity.py`
(converted shards vs transformers), `cli.py` / `hub_source.py` (their command lines).
Runtime, inside a training job: `load.py` builds and fills a rank's chunks, `mp_save.py`
stages a checkpoint folder atomically and writes a rank's model tensors. Shared by both:
`rules.py` (the key table), `mp_layout.py` / `mp_reader.py` (the layout on disk),
`st_stream.py`, `atomic.py`, `tensor_source.py`. What a training checkpoint holds beside
the model is `hfmeg.train.checkpointing`'s business.
"""
