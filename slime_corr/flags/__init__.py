"""Every command-line flag of the main job and of the Megatron-LM / slime extension, defined once.

- `compose`: adding a flag to a host parser (slime's, Megatron-LM's) and recording which flags were given;
- `correction`, `loss_terms`, `trainer`, `model`, `monitoring`, `megatron_lm`: one module per flag group, holding
  the group titles, which fields each group shows, and the flags that are not plain fields;
- `main_job`: the main job's parser; `checks`: every check across configs (and against Megatron-LM's own flags).

The flag fields themselves (`flag(...)`, a config dataclass field that carries its flag's help, choices and
spelling, and `add_flags`) live on the ground floor, `slime_corr.fields`, so that every config module can import
them without importing this layer.
"""
