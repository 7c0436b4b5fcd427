"""Quality on a real model: SmolLM2-135M (offline) on WikiText-2.

``kvtier eval codecs`` measures what each codec does to real K/V (reconstruction and attention
output); the model and text loaders here are shared with the tests and examples.
"""
