"""From recipe to package: capture, rewrite pipeline, structural export, package writer, re-export."""
