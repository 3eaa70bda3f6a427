"""What tests, benchmarks and scripts share and the product does not ship:
the development data, the comparisons of engine outputs, and probes run
inside engines."""
