"""The SGLang engine and its CPU shim."""
