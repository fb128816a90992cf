"""Generation for online RL: engines behind one interface (`engine.Engine`: generate -> token ids and log-probs;
load new weights). Built: an in-process transformers model (`transformers_engine.py`). Not built: a vLLM server."""
