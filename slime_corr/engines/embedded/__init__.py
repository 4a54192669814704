"""The embedded engine: SGLang 0.5.23's HTTP protocol served on 127.0.0.1 from a small torch model (`engine`), with
its control endpoints (`control`), request parsing (`requests`), models and tokenizers (`model`) and seeded
sampling (`sampling`). Bit-reproducible: a seeded request gives the same tokens whatever it was batched with."""
