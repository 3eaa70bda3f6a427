"""OSCAR INT2 KV pages: byte layout (format.py) and reference ops."""
