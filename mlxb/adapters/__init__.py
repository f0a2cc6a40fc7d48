"""Many LoRA adapters over one base model (``--adapters NAME=PATH,...``), each batch row with its own.

The engine enters through ``mlxb.adapters.lora``: ``install`` turns the model's adapted modules into
multi-adapter layers and ``LoRAContext.set`` says, before each forward, which adapter every row uses.
``concat`` is the ``--lora-path concat`` variant (adapters' shrink factors ride on the base product).
"""
