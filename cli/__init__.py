"""The ``shmcoll`` command line (installed as ``shmcoll.cli``)."""
