"""All rich rendering lives here: pure functions from data to renderables."""
