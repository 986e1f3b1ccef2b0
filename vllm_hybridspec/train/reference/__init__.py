"""Reference models: the targets and drafters committed under ``models/``.

A code corpus from the running interpreter's standard library (``corpus``), a byte-level BPE
tokenizer trained on it (``tokenizer``), two small targets -- a Qwen3-Next GDN + MoE hybrid and a
dense Qwen3 -- (``targets``) pretrained on it (``pretrain``), prompts for drafter training
(``generate``), acceptance measurement and capture records outside vLLM (``evaluate``), and the whole
pipeline (``pipeline``, ``hybridspec models``).
"""
