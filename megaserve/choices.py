"""The values `--backend` and `--dtype` take, importable without JAX (the CLI's parser)."""

BACKENDS = ("xla", "pallas")
BACKEND_CHOICES = ("auto", *BACKENDS)  # auto: see megaserve.runner.factory.choose_backend
DTYPE_CHOICES = ("auto", "bf16", "f32")  # auto: see megaserve.model.serving_dtype
