"""Model, tokenizer and chat template. Import the submodules directly; this package
imports nothing so that JAX-free processes can use the tokenizer."""
