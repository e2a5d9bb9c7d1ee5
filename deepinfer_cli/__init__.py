"""The `deepinfer` command line (Typer): one module per command, assembled in `app.py`."""
