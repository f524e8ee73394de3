"""Engines: how a model is trained on this hardware. The loop talks to :class:`~zerotrain.engines.base.Engine`
only; :func:`~zerotrain.engines.build.build_engine` picks DeepSpeed (:mod:`~zerotrain.engines.deepspeed`) or plain
PyTorch (:mod:`~zerotrain.engines.plain`). What each keeps per parameter is in :mod:`~zerotrain.engines.states`;
every use of DeepSpeed's internals is in :mod:`~zerotrain.engines.ds_private`."""
