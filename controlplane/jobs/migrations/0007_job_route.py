from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_budget_reservation"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="route",
            field=models.CharField(blank=True, max_length=24),
        ),
    ]
