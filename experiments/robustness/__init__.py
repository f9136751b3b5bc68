"""The bad-input campaign of issue #21 (``campaign.py``) and its catalogue of cases (``cases.py``)."""
