"""Pure models the tests hold the Lua and the worker to (oracles): not shipped in the package."""
