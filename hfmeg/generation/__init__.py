"""Generation for online RL: engines behind one interface (`engine.Engine`: generate -> token ids and log-probs;
load new weights; close): an in-process transformers model (`transformers_engine.py`) and a vLLM worker process in
vLLM's own virtualenv (`vllm_engine.py`, `vllm_worker.py`)."""
