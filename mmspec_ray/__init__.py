"""mmspec-ray: lossless tree speculative decoding for vision-language models, on Ray."""

__version__ = "0.1.0"
