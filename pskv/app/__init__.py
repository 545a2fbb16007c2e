"""pskv's training application, apart from the core: ``from pskv.app import datasets, models``."""
