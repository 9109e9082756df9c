"""Django project for the django-q2 peer (bench only; never touches Orbit's project)."""
