"""transformer-mt: train, run and score Transformer translation models. `load` is the Python API."""

__version__ = "0.1.0"


def load(checkpoint=None, **options):
    """A Translator for a run directory or checkpoint (a list of them: an ensemble); `options` are
    `inference.load_translator`'s (device, precision, beam, alpha, max_len, engine). Imported late,
    so that `import transformer_mt.config` stays free of torch."""
    from .inference import load_translator

    return load_translator(checkpoint, **options)
