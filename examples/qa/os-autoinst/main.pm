use strict;
use warnings;
use testapi;
use autotest;

autotest::loadtest "tests/save_dialog.pm";
1;
