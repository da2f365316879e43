"""One optimizer step: normalise, unscale, clip, step or skip, and the per-step log.
Imports only errors, lifecycle/, checkpoint/, state/, units and gangs."""
