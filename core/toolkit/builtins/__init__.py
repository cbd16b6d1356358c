"""The core's own plugins, registered through the toolkit entry-point group like any other."""
