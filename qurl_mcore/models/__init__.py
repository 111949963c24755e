"""Small real models that ship inside packages, for tests and demos (nothing is downloaded at run time)."""
