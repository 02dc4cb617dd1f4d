"""The admin console's services: :mod:`.login` (sessions, CSRF), :mod:`.views` and :mod:`.reports` (its pages' data)."""
