"""Reading a package: manifest, calling conventions, graph archives, weights and checkpoints."""
