"""Everything that generates or judges load: emulator, load generator, sweep, simulator."""
