"""Architecture definitions: one module per architecture, written once against `models.ops.Ops`."""
