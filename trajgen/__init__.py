"""The batch runner's internals: dataset -> plan -> workers -> results -> writer -> merge -> statistics."""
