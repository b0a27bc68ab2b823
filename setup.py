# The configuration lives in pyproject.toml; this file lets older tools install the project.
from setuptools import setup

setup()
