"""The closed loop on one GPU: a trained target, our samples, SpecForge's trainer, SGLang's EAGLE-3.

Modules by step: ``corpus`` (chats cut from Python sources), ``target`` (tokenizer, model,
training), ``features`` (the training features of every compared pipeline), ``drafters``
(SpecForge configs, training, export), ``serving`` (EAGLE-3 servers and the measurement).
``tests/gpu/closed_loop.py`` runs them in order and resumes where a call stopped.
"""
