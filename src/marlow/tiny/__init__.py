"""The tiny world: a Qwen3-architecture model small enough to pre-train and RL-train on a CPU.

* :mod:`~marlow.tiny.tokenizer`: a character tokenizer built locally, with a chat template;
* :mod:`~marlow.tiny.model`: three named scales (``tiny-s``, ``tiny-m``, ``tiny-l``);
* :mod:`~marlow.tiny.mathgen`: synthetic integer arithmetic, its splits and a reference solver;
  :mod:`~marlow.tiny.splits`: the train/validation split rule both generators share;
* :mod:`~marlow.tiny.corpus`: role-format examples with imperfect, tunable skill (and the
  :class:`~marlow.tiny.corpus.RoleCorpus` machinery both corpora use);
* :mod:`~marlow.tiny.codegen`: synthetic code problems (function-call and stdin/stdout) with
  hidden tests; :mod:`~marlow.tiny.codecorpus`: the code world's role corpus;
* :mod:`~marlow.tiny.pretrain`: pre-training with a content-addressed cache, one model per task.

Nothing here touches the network, and nothing here imports the rollout engine or the rewards:
measuring how well a tiny model plays its roles is :mod:`marlow.worlds.tinyeval`.
"""
