"""The training application built on pskv: data sets, models, ``pskv train`` and ``pskv bench``.

Not part of the core: it has its own line budget, and nothing in the core imports it.

>>> from pskv.app import datasets, models
"""
