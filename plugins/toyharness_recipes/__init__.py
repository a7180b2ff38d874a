"""Built-in recipes, registered through the `toyharness.recipes` entry points like any plugin."""
