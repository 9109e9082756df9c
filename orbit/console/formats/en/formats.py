# The console's times: UTC (TIME_ZONE), RFC 3339, to the millisecond. A start
# window is one second and a lease 30: minutes say nothing about either.
DATETIME_FORMAT = r"Y-m-d\TH:i:s.v\Z"
SHORT_DATETIME_FORMAT = DATETIME_FORMAT
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = DATE_FORMAT
TIME_FORMAT = "H:i:s.v"
