"""`manage.py create_operator --email E [--name N]`: an MSP operator, the password read from the terminal (twice)
or, for scripts, one line of standard input with `--password-stdin`. Nothing else of the admin is needed."""

from __future__ import annotations

import getpass
import sys

from django.core.management.base import BaseCommand, CommandError

from tenants import services
from tenants.errors import ServiceError


class Command(BaseCommand):
    help = "Create an MSP operator (staff holding tenants.operate): the first one, or another."

    def add_arguments(self, parser):
        parser.add_argument("--email", required=True)
        parser.add_argument("--name", default="", help="full name")
        parser.add_argument("--password-stdin", action="store_true",
                            help="read the password from the first line of standard input (scripts)")

    def handle(self, *args, email, name, password_stdin, **opts):
        if password_stdin:
            password = sys.stdin.readline().rstrip("\r\n")
        else:
            password = getpass.getpass("Password: ")
            if getpass.getpass("Password (again): ") != password:
                raise CommandError("the passwords differ")
        try:
            user = services.create_operator(email, password, full_name=name)
        except ServiceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}" if exc.field else exc.message) from None
        self.stdout.write(f"operator {user.email} created: sign in at /login/ (the console is /console/)")
