# The console's times: UTC (TIME_ZONE), RFC 3339, to the microsecond, as the
# API writes them (orbit.timefmt): a start window is one second and a lease
# 30, so minutes say nothing. (Django's date format has no millisecond
# field; templates/ and console.admin_base write the same six digits.)
DATETIME_FORMAT = r"Y-m-d\TH:i:s.u\Z"
SHORT_DATETIME_FORMAT = DATETIME_FORMAT
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = DATE_FORMAT
TIME_FORMAT = "H:i:s.u"
