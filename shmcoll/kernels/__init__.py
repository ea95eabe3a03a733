"""Payload kernels: the only code that does arithmetic on user data."""
