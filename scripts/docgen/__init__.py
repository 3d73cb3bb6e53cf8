"""Generators and checks for the documentation site (mkdocs.yml, docs/): the CLI reference made
from the CLI itself, the error messages collected from the code, the docs' commands and links."""
